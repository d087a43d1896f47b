"""Emulated devices and injected faults: named testing and benchmark modes, each off by default (the
`[emulate]` keys; docs/emulation.md). A rank's compute stretched by a factor (`slowdown`), every layer a
fixed cost (`layer_cost`), faults at chosen steps and phases (`faults`); the run entry turns them on
through `attach`, so the trainer and the resilience session know nothing of them."""
