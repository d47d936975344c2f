"""From a plan to per-rank action lists: the IR, placement rules, the generators, the validator, torch.distributed.pipelining's text format."""
