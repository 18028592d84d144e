"""Tinker's per-token losses this project computes, by the name the SDK sends, and the inputs
each reads per position besides the target tokens (:mod:`.per_token` computes them). No
torch: the API's HTTP side checks requests against it."""

INPUTS = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
}
