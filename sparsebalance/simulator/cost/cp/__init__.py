"""Context parallelism, priced: one sequence's attention layer split over the ranks of a CP group.

* :mod:`.shards` -- how a sequence lies on the group (layouts) and the pairs each rank computes;
* :mod:`.calls` -- a ring step as a kernel call: its call, merge (forward) or accumulation (backward);
* :mod:`.ring` -- the ring (hierarchical ring, all-gather) recurrence over priced steps and transfers, and
  what it reports (:class:`.ring.RingReport`);
* :mod:`.pricing` -- the group's layer time from the profile, folded into the latency model's tables;
* :mod:`.placement` -- ``cp_split = "per-sequence"``: a degree and rank group per sequence;
* :mod:`.trace` -- the group's figures and trace rows of an iteration, for the executor.

The token share of a CP rank and its gradient group are the layout's (``Layout.rank_tokens``,
``Layout.group_tokens``, ``Layout.grad_group``). docs/costmodel.md section 11.
"""
