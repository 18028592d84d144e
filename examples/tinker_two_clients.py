"""Two tinker SDK clients training at once against a local `mmlora api` service, then one
sampling from its adapter (the README's transcript).

    MMLORA_API_KEYS=tml-alice,tml-bob mmlora api --run-dir runs/api --port 8000 hf_dir=null &
    python examples/tinker_two_clients.py --port 8000
"""

from __future__ import annotations

import argparse
import sys
import threading

import tinker
from tinker import types


def datum(tokens: list[int]) -> types.Datum:
    """Next-token targets for every position (weights 1: the loss is their sum)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def train(url: str, key: str, text: str, steps: int, out: dict) -> None:
    with tinker.ServiceClient(base_url=url, api_key=key) as service:
        client = service.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
        batch = [datum([1] + list(text.encode()))]  # the byte tokenizer: bos, then bytes
        for step in range(steps):
            loss = client.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            if step % 10 == 0 or step == steps - 1:
                sys.stdout.write(f"{key}: step {step} loss {loss:.2f}\n")  # one write per line
        if key == "tml-alice":
            sampler = client.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints([1] + list(text[:4].encode()))
            params = types.SamplingParams(max_tokens=len(text) - 4, temperature=0.01, seed=0)
            result = sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
            out["sample"] = text[:4] + bytes(result.sequences[0].tokens).decode(errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    url, out = f"http://127.0.0.1:{args.port}", {}
    jobs = [("tml-alice", "hello multi-lora"), ("tml-bob", "batched together")]
    threads = [
        threading.Thread(target=train, args=(url, key, text, args.steps, out)) for key, text in jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"tml-alice samples from her adapter: {out['sample']!r}")


if __name__ == "__main__":
    main()
