"""The fixed-shape trace the engine benchmarks serve: B requests of PP random prompt tokens
(ids from 17, past SmolLM2's special tokens, below its vocabulary of 49,152), TG new tokens
each past the end of turn, all arriving at once; drawn from seed B."""
import json, random, tempfile


def fixed_shape_trace(b, pp, tg):
    """Writes the trace to a temporary .jsonl file and returns its path (the caller deletes it)."""
    rng = random.Random(b)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for _ in range(b):
            tokens = [rng.randrange(17, 49152) for _ in range(pp)]
            f.write(json.dumps({"tokens": tokens, "max_new_tokens": tg, "ignore_eos": True}) + "\n")
        return f.name
