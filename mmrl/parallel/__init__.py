"""Several processes: the process groups and the decisions every rank takes together, FSDP2 / DDP / HSDP wrapping
and policy-aware sampling of whole groups (`distributed`), context parallelism of a video transformer's tokens
(`context_parallel`), and FSDP2 shard helpers (`shards`). Only this package compares train.parallel's values."""
