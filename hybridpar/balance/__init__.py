"""Dynamic load balancing: measured load scores (`scores`), straggler detection with hysteresis
(`detect`), speed-fitted stage partitions and data-parallel splits (`repartition`), the policy (`control`),
and live moves of layers and optimizer state between running ranks (`migrate`, `live`). The emulated slow
devices it is tested and benchmarked against are hybridpar/emulate/."""
