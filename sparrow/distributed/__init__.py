"""Tensor parallelism over `torch.distributed`: one process per device, a process group per
engine (`group`), each rank's share of the weights (`shard`), and the ranks that follow the
engine's steps (`ranks`)."""
