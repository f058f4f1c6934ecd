"""Evaluation that decides what ships: the best checkpoint kept and exported and early stopping
(:mod:`.best`), greedy samples at each evaluation (:mod:`.samples`), and benchmark scores from
EleutherAI's lm-evaluation-harness on the exported model (:mod:`.harness`); their options'
checks (:mod:`.options`)."""
