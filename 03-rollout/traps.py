"""The traps that make this chapter capture tokens at generation time, shown on real vLLM.

    .venv/bin/python 03-rollout/traps.py            # tiny random model on CPU, about a minute

Each trap is measured, not asserted: docs/03-rollout.md reads the output. For trap 1 the sampler is steered (structured
outputs, a logit bias) to complete "```output" with the token "tan", as a real model may with any token starting "t".
"""
from __future__ import annotations

import os
import sys

FIXED_TEXT = "Let me compute it with Python.\n```python\nprint(123 * 456)\n```\n"


def main(argv: list[str] | None = None) -> int:
    from lab_cli import script_parser

    script_parser(__doc__).parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    from rollout import STOP, make_llm, render_prompt
    from tiny_model import temp_tiny_model
    from trajectory_view import token_pieces

    model = temp_tiny_model()
    llm = make_llm(model, dtype="float32", max_model_len=2048)
    tok = llm.get_tokenizer()
    prompt = TokensPrompt(prompt_token_ids=tok.encode(render_prompt("What is 123 * 456?"), add_special_tokens=False))

    def show(ids):
        return "|".join(p.replace("\n", "\\n") for p in token_pieces(tok, ids))

    print("1. A stop string that ends inside a token")
    ban = {tok.convert_tokens_to_ids(s): -100.0 for s in ("ut", "put", "output")}  # every clean ending of "```output"
    params = SamplingParams(max_tokens=40, stop=[STOP], seed=0, logit_bias={**ban, tok.convert_tokens_to_ids("tan"): 100.0},
                            structured_outputs=StructuredOutputsParams(regex=r"Go\.\n```python\nprint\(7\)\n```\n```output(an)?"))
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    print(f"   stop_reason {out.stop_reason!r}; text ends {out.text[-12:]!r} (cut before the stop string)")
    print(f"   last tokens {show(out.token_ids[-4:])}  ->  decode(token_ids) ends {tok.decode(out.token_ids)[-12:]!r}")
    print(f"   re-tokenizing text + stop string gives {show(tok.encode(out.text + STOP, add_special_tokens=False)[-4:])}: "
          f"the sampled token {show(out.token_ids[-1:])!r} is gone")

    print("2. One text, several tokenizations")
    regex = "".join("\\" + c if c in r".()*[]{}\^$|?+" else c for c in FIXED_TEXT).replace("\n", r"\n")
    params = SamplingParams(n=8, max_tokens=80, seed=0, structured_outputs=StructuredOutputsParams(regex=regex))
    samples = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    texts = {tok.decode(o.token_ids, skip_special_tokens=True) for o in samples}
    spellings = {tuple(o.token_ids) for o in samples}
    again = tok.encode(FIXED_TEXT, add_special_tokens=False)
    print(f"   8 samples, {len(texts)} distinct text(s), {len(spellings)} distinct token sequences, "
          f"lengths {sorted(len(o.token_ids) for o in samples)} (EOS included)")
    print(f"   re-tokenizing the text: {len(again)} tokens; equal to a sampled sequence: "
          f"{any(list(s[:len(again)]) == again and len(s) == len(again) + 1 for s in spellings)}")
    print(f"   e.g. {show(samples[0].token_ids[:8])}  vs  {show(samples[1].token_ids[:8])}  vs re-tokenized {show(again[:8])}")

    print("3. A group: n=k versus k copies with one seed")
    free = dict(max_tokens=12, temperature=1.0)
    copies = llm.generate([prompt] * 4, SamplingParams(seed=7, **free), use_tqdm=False)
    group = llm.generate([prompt], SamplingParams(n=4, seed=7, **free), use_tqdm=False)[0].outputs
    print(f"   4 copies, seed 7: {len({tuple(c.outputs[0].token_ids) for c in copies})} distinct sample(s); "
          f"n=4, seed 7: {len({tuple(o.token_ids) for o in group})} distinct samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
