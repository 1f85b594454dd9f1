"""Per-rank memory of DDP and FSDP2 training steps, predicted from one process on top of ``replay()``."""
