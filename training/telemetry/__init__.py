"""What a run tells: throughput, MFU and memory (:mod:`.metrics`), its course in
``metrics.jsonl`` (:mod:`.runlog`) drawn as curves (:mod:`.curves`), and CloudWatch metrics
(:mod:`.cloudwatch`)."""
