"""The tolerances of an audit, in nats of log-probability, each set from bench/bench_model_proof.py
(figures and the command in bench/RESULTS.md, "Proof of model").

Between them lies the whole rule set: the same weights on another backend, thread count or batch
size stay far inside each bound; another seed of the same shape and a faked evidence fall far
outside; another quant of the same model falls outside when its rounding moves the log-probabilities
more than the backends do (Q4_0 of the demo model, Q4_K_M), and cannot be told from the claimed one
when it does not (Q8_0 and F16 of the same weights: within the spread lavapipe Vulkan shows).
"""

from __future__ import annotations

# Greedy answers: a token the claimed model would not have picked is a near-tie only if it falls
# below the verifier's best by at most this much. Measured (4 prompts each): the same weights diverged
# only at near-ties, by at most 0.0000 (tiny, CPU vs lavapipe Vulkan) and 0.146 nats (demo model's
# Q8_0 and F16, lavapipe Vulkan vs CPU); another seed diverged at every token, by up to 0.67 (tiny);
# the demo's Q4_0 by 2.49. It was 0.3 until CUDA was measured: the demo's own Q4_K_M served by an
# H100's CUDA build, greedy, against a CPU verifier (bench/RESULTS.md, "Proof of quant", CUDA) broke
# 0.3 in 39 of 160 honest answers, by up to 1.25 nats (6,400 tokens: 41 gaps past 0.3, 9 past 0.5, one
# past 0.75), so one honest answer in four would have blocked its node. 2.0 is 1.6x the largest honest
# gap seen on any backend; what lies between is the whole-answer statistic's (contract.model_proof).
GREEDY_TIE_NATS = 2.0

# Evidence: each committed top-k entry's probability must match the verifier's within this much (and the committed
# best the verifier's best). Compared as probabilities, not log-probabilities: a far-down entry of a confident position
# moves by nats between backends while its probability stays near 0 (the demo's Q4_K_M on an H100's CUDA: a runner-up
# at -6.4 there and -15.7 on the CPU; in nats the old 1.0 bound refused 14 of 30 honest answers there, and 3 of 70 of its
# Q8_0). Measured, the largest difference in an answer (bench_quant_evidence.py records, bench/RESULTS.md "Proof of
# quant from the committed values"): honest F16 0.005 on any backend, Q8_0 0.22 (H100 CUDA), Q4_K_M 0.30 (H100 CUDA);
# cheaper quants 0.13-0.67. 0.5 is 1.6x the widest honest one: it refuses a forger's certainty where the claimed model
# is unsure, and what it lets by, the committed values' whole-answer test (`proof.values`) judges.
EVIDENCE_PROB_TOLERANCE = 0.5

# The verifier scores this many more candidates than the evidence carries, so a committed token that
# fell just behind the k-th on the verifier's backend is still found.
VERIFIER_TOP_K_FACTOR = 4

# Sampled answers: refuse when the answer's log-likelihood under the claimed model, at the request's
# temperature, lies this many standard deviations below what the model's own samples score
# (z-score over the answer's tokens). Measured on 64-token answers at T 0.8: honest +1.7, +1.5; the
# demo's Q4_0 only -3.2, -1.0. So -6 refuses no honest node (~1e-9 of a normal tail) and, at this
# length, no near quant either: the test needs far longer answers, or a node's audits pooled.
SAMPLED_Z_REFUSE = -6.0
# Below this many tokens the sampled test is not run (the z-score is not yet near normal): no verdict.
SAMPLED_MIN_TOKENS = 32
