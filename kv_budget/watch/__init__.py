"""The watch step, while the engine serves: live samples against the plan
(:mod:`.live`), the status file each engine rewrites (:mod:`.status`), and
the figures the API server publishes from it (:mod:`.metrics`)."""
