"""Seeing a trajectory: a standalone HTML page and a text drawing. The story: docs/03-rollout.md.

One box per token, coloured by its mask; neighbouring boxes alternate shades so that token boundaries show."""
from __future__ import annotations

import codecs
import html


def render_html(trajectories: list, tokenizer, rewards: list | None = None, title: str = "rollouts",
                total: int | None = None) -> str:
    """A standalone page: per trajectory its summary, its tool calls and every token as a box.
    `rewards`: chapter 04's RewardResults, one per trajectory (None: the stored one). `total`: when it shows fewer."""
    shown = len(trajectories)
    count = f"{shown} of {total}" if total is not None and total != shown else f"{shown}"
    scored = rewards or [None] * shown
    return "".join([_PAGE_HEAD.format(title=html.escape(title), n=count),
                    *(_render_one(t, tokenizer, s) for t, s in zip(trajectories, scored)), "</body></html>\n"])


def _render_one(t, tokenizer, scored) -> str:
    reward = t.reward if t.reward is not None else (scored.reward if scored is not None else None)
    model_n = sum(t.loss_mask)
    facts = [
        f"reward <b>{'—' if reward is None else f'{reward:+g}'}</b>",
        f"finish <b>{html.escape(t.finish_reason)}</b>{' (truncated)' if t.truncated else ''}",
        f"{model_n} model + {len(t.token_ids) - model_n} observation tokens",
        f"{t.num_tool_calls} tool call(s), code_ok={t.code_ok}",
        f"weights v{t.weight_version}",
        f"reference <code>{html.escape(t.reference)}</code>",
    ]
    if scored is not None:
        answer = "none" if scored.answer is None else f"<code>{html.escape(scored.answer)}</code>"
        facts.append(f"boxed answer {answer}, correct={scored.correct}")
    if t.advantage is not None:
        facts.append(f"advantage {t.advantage:+.3f}")
    out = [f'<section><h2>problem {html.escape(t.problem_id)} · sample {t.group_index}</h2>',
           f'<p class="facts">{" · ".join(facts)}</p>']
    if t.tool_calls:
        out.append("<table><tr><th>#</th><th>code</th><th>ok</th><th>exit</th><th>timed out</th>"
                   "<th>latency</th><th>observation (as the model saw it)</th><th>tokens</th></tr>")
        for i, c in enumerate(t.tool_calls):
            out.append(f"<tr><td>{i}</td><td><pre>{html.escape(c.code) or '<i>no complete block</i>'}</pre></td>"
                       f"<td>{c.ok}</td><td>{c.returncode}</td><td>{c.timed_out}</td><td>{c.latency * 1000:.0f} ms</td>"
                       f"<td><pre>{html.escape(c.observation)}</pre></td><td>{c.start}–{c.end}</td></tr>")
        out.append("</table>")
    out.append('<details><summary>prompt: %d tokens</summary><div class="toks">' % len(t.prompt_ids))
    out += [_box("p", i, tok, piece, None) for i, (tok, piece) in enumerate(zip(t.prompt_ids, token_pieces(tokenizer, t.prompt_ids)))]
    out.append('</div></details><div class="toks">')
    for i, (tok, piece, m, lp) in enumerate(zip(t.token_ids, token_pieces(tokenizer, t.token_ids), t.loss_mask, t.logprobs)):
        out.append(_box("m" if m else "o", i, tok, piece, lp if m else None))
    out.append("</div></section>\n")
    return "".join(out)


def _box(kind: str, pos: int, tok: int, piece: str, logprob: float | None) -> str:
    mask = {"p": "prompt", "m": "mask 1", "o": "mask 0"}[kind]
    tip = f"#{pos} id {tok} {mask}" + ("" if logprob is None else f" logprob {logprob:.3f}")
    shown = html.escape(piece).replace("\n", "↵\n") if piece else "∅"
    return f'<span class="{kind}{pos % 2}" title="{tip}">{shown}</span>'


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, so that the pieces join into the decoded text: a byte-level token that holds half a
    character adds nothing, the next one the whole character. Other tokenizers decode each token on its own."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return [tokenizer.decode([i]) for i in ids]
    byte_of = _byte_level_alphabet()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = []
    for token in tokenizer.convert_ids_to_tokens(ids):
        raw = b"".join(bytes([byte_of[ch]]) if ch in byte_of else ch.encode() for ch in token)
        pieces.append(decoder.decode(raw))
    if pieces:
        pieces[-1] += decoder.decode(b"", final=True)
    return pieces


def draw_tokens(t, tokenizer) -> str:
    """The response as text, one line per segment ("model (mask 1, 4 tokens): ```|output|..."), tokens split by "|"."""
    pieces = [p.replace("\n", "↵") or "∅" for p in token_pieces(tokenizer, t.token_ids)]
    lines, start = [f"prompt: {len(t.prompt_ids)} tokens"], 0
    for end in range(1, len(t.token_ids) + 1):
        if end == len(t.token_ids) or t.loss_mask[end] != t.loss_mask[start]:
            kind = "model (mask 1" if t.loss_mask[start] else "observation (mask 0"
            lines.append(f"{kind}, {end - start} tokens): " + "|".join(pieces[start:end]))
            start = end
    return "\n".join(lines)


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of byte-level BPE's byte-to-character map (GPT-2's): printable Latin-1 bytes stand for themselves, the
    other 68 move to code points 256 and up, in byte order, so that no token holds a control character or a space."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(shifted)}


_PAGE_HEAD = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #222; }}
section {{ border-top: 2px solid #ccc; margin-top: 1.5em; }}
.facts {{ color: #444; }}
table {{ border-collapse: collapse; margin: .5em 0; }}
td, th {{ border: 1px solid #ccc; padding: 2px 6px; vertical-align: top; text-align: left; }}
pre {{ margin: 0; white-space: pre-wrap; }}
.toks {{ font: 13px/1.9 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }}
.toks span {{ border-radius: 2px; box-shadow: inset -1px 0 0 #fff; }}
.p0 {{ background: #e4e4e4; }} .p1 {{ background: #d0d0d0; }}
.m0 {{ background: #d4e6ff; }} .m1 {{ background: #9ec2f5; }}
.o0 {{ background: #ffe2bf; }} .o1 {{ background: #fbbd72; }}
.legend span {{ padding: 1px 6px; }}
</style></head><body>
<h1>{title}: {n} trajectories</h1>
<p class="legend">Each box is one token. <span class="p0">prompt</span> <span class="m0">model</span><span class="m1">token</span>
(loss mask 1: the trainer learns from these) <span class="o0">observation</span><span class="o1">token</span>
(loss mask 0: the tool wrote these). ↵ is a newline inside a token, ∅ a token that holds only part of a character.
Hover a box for its position, id and log-prob.</p>
"""

