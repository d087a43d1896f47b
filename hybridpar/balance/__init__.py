"""Dynamic load balancing: measured load scores (`scores`), straggler detection with hysteresis
(`detect`), speed-fitted stage partitions and data-parallel splits (`plan`), the policy (`control`),
live moves of layers and optimizer state between running ranks (`migrate`, `live`), and the labelled
emulation modes (`emulate`)."""
