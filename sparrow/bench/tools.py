"""Tool-call and reasoning parsing per streamed token, on the CPU: what the OpenAI layer adds
to each token of a chat completion that may call tools.

    python -m sparrow.bench.tools [--calls 4] [--rounds 5] [--out bench-out/tools.json]

A completion in each family's markup (`sparrow.server.tool_parsers`): a think block, some
content, then `--calls` tool calls with a few arguments each, tokenised with the Qwen3.5/3.6
vocabulary and fed to the splitters one token's text at a time, as the server streams it.
Reported per format: microseconds per token through the tool-call splitter, through the
reasoning splitter, and both, median of rounds, and the calls found (which must be all).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sparrow.eval.report import write_report
from sparrow.server.reasoning import PARSERS as REASONING
from sparrow.server.reasoning import ReasoningSplitter
from sparrow.server.tool_parsers import PARSERS, ToolCallSplitter
from sparrow.tokenizer import load_tokenizer

NS = "]<]minimax[>["
ARGS = {"city": "Paris", "days": 3, "units": "metric", "detail": {"hourly": True, "wind": False}}
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"type": "string"},
            "detail": {"type": "object"},
        },
    }
}


def qwen3_call(name: str, args: dict) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>\n"


def m3_value(value) -> str:
    if isinstance(value, dict):
        return "".join(f"{NS}<{k}>{m3_value(v)}{NS}</{k}>" for k, v in value.items())
    return json.dumps(value) if isinstance(value, bool) else str(value)


def m3_calls(name: str, args: dict, count: int) -> str:
    invoke = f'{NS}<invoke name="{name}">{m3_value(args)}{NS}</invoke>\n'
    return f"{NS}<tool_call>\n{invoke * count}{NS}</tool_call>"


def completion(fmt: str, calls: int) -> tuple[str, str]:
    """(reasoning parser name, the completion text) of a format."""
    think = "The user wants the weather, so I call the tool for each city they named. " * 4
    content = "Let me look that up for you.\n\n"
    if fmt == "qwen3":
        return "qwen3", f"{think}</think>\n\n{content}" + qwen3_call("get_weather", ARGS) * calls
    return "minimax_m3", f"{think}</mm:think>\n\n{content}" + m3_calls("get_weather", ARGS, calls)


def per_token_us(deltas: list[str], fmt: str, reasoning: str, which: str) -> tuple[float, int]:
    """Microseconds per delta through the splitters `which` names, and the calls found."""
    tools = ToolCallSplitter(PARSERS[fmt], SCHEMAS) if which != "reasoning" else None
    think = ReasoningSplitter(REASONING[reasoning], True) if which != "tools" else None
    found = 0
    start = time.perf_counter()
    for delta in deltas:
        text = delta
        if think is not None:
            text = think.feed(text)[1]
        if tools is not None:
            found += len(tools.feed(text)[1])
    if tools is not None:
        tools.flush()
    return (time.perf_counter() - start) / len(deltas) * 1e6, found


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench-out/tools.json")
    args = p.parse_args(argv)
    tok = load_tokenizer(None)
    rows = {}
    for fmt in PARSERS:
        reasoning, text = completion(fmt, args.calls)
        deltas = [tok.decode([t]) for t in tok.encode(text)]
        row: dict = {"tokens": len(deltas)}
        for which in ("tools", "reasoning", "both"):
            times, found = [], 0
            for _ in range(args.rounds):
                us, found = per_token_us(deltas, fmt, reasoning, which)
                times.append(us)
            row[f"{which}_us_per_token"] = round(statistics.median(times), 2)
            if which != "reasoning" and found != args.calls:
                raise RuntimeError(f"{fmt}: {found} calls parsed, not {args.calls}")
        rows[fmt] = row
        print(f"{fmt}: {row}")
    report = {"calls": args.calls, "rounds": args.rounds, "rows": rows}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
