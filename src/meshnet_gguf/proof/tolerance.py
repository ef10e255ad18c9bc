"""The tolerances of an audit, in nats of log-probability, each set from bench/bench_model_proof.py
(figures and the command in bench/RESULTS.md, "Proof of model").

Between them lies the whole rule set: the same weights on another backend, thread count or batch
size stay far inside each bound; another seed of the same shape and a faked evidence fall far
outside; another quant of the same model falls outside when its rounding moves the log-probabilities
more than the backends do (Q8_0 and Q4_0 of the demo model), and cannot be told from the claimed
one when it does not (an F16 written from the same quantized weights: the same numbers).
"""

from __future__ import annotations

# Greedy answers: a token the claimed model would not have picked is a near-tie only if it falls
# below the verifier's best by at most this much. Measured: the same weights on CPU and lavapipe
# Vulkan diverged only where the two best were within 0.0015 nats (tiny model) / 0.03 (demo
# model); another seed diverged at every token, by up to 0.67 (tiny) and several nats (demo).
GREEDY_TIE_NATS = 0.1

# Evidence: each committed top-k log-probability must match the verifier's within this much (the
# quantization's half step is added). Measured worst case for the same weights on two backends:
# 0.0015 (tiny F32) and 0.05 (demo Q4_K_M, CPU against Vulkan); another quant of the demo: 0.2 and
# more; another seed: 0.65 (tiny) and several nats (demo).
EVIDENCE_LOGPROB_NATS = 0.1

# The verifier scores this many more candidates than the evidence carries, so a committed token that
# fell just behind the k-th on the verifier's backend is still found.
VERIFIER_TOP_K_FACTOR = 4

# Sampled answers: refuse when the answer's log-likelihood under the claimed model, at the request's
# temperature, lies this many standard deviations below what the model's own samples score
# (z-score over the answer's tokens). Honest samples measured within +-3; 6 keeps the false refusal
# rate under ~1e-9 of a normal tail while another model's samples measured far below.
SAMPLED_Z_REFUSE = -6.0
# Below this many tokens the sampled test is not run (the z-score is not yet near normal): no verdict.
SAMPLED_MIN_TOKENS = 32
