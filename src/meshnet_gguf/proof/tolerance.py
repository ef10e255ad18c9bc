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

# Evidence: each committed top-k log-probability must match the verifier's within this much (the
# quantization's half step is added). Measured worst case for the same weights on two backends:
# 0.0022 (tiny F32) but 0.51 (demo Q8_0, lavapipe Vulkan vs CPU: far-down entries of the top-4
# move most); another quant of the demo 0.78 to 2.0; a forger claiming certainty 3.0 to 4.3;
# another seed 0.90 (tiny). The bound sits at twice the backends' spread: it catches forgers and
# far quants, not near ones (the greedy or sampled check must carry those).
EVIDENCE_LOGPROB_NATS = 1.0

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
