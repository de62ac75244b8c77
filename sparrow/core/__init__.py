"""CPU-only bookkeeping: requests, sampling parameters, block and state-slot pools, the
scheduler. Nothing here touches a GPU."""
