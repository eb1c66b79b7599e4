"""Developer tools outside the library's core: the trainer benchmark (:mod:`.benchmark`),
its workloads (:mod:`.workloads`), rollout-file tree statistics (:mod:`.tree_stats`) and
the long-tailed task of the async benchmark (:mod:`.longtail`)."""
