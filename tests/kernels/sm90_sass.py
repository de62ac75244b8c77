"""The sm_90 SASS of every kernel in `sm90_cases.py`, to compare kernels before and after a
change (run without TRITON_INTERPRET):

    python -m tests.kernels.sm90_sass DIR [case ...]     writes DIR/<case>.sass
    python -m tests.kernels.sm90_sass --diff DIR_A DIR_B  the cases whose SASS differs

Each constant-bank load of a kernel parameter is written with the parameter's name instead
of its offset, and the kernel's name is left out, so kernels whose parameter lists differ
only in parameters they never load compare equal where their code is the same.
"""

import re
import sys
from pathlib import Path

from tests.kernels.sm90_cases import CASES, compile_kernel

_PARAM = re.compile(r"\.param\s+\.(\w+)(?:\s+\.ptr\s+\.global\s+\.align\s+\d+)?\s+\w+_param_(\d+)")
_BANK = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")


def param_offsets(ptx: str, params: list[str]) -> dict[int, str]:
    """Constant-bank offset -> parameter name (sm_90: parameters from 0x210, each aligned to
    its size; the ones past `params` are Triton's scratch pointers)."""
    names, offset = {}, 0x210
    for kind, index in _PARAM.findall(ptx):
        size = 8 if kind in ("u64", "b64", "s64") else 4
        offset = -(-offset // size) * size
        name = params[int(index)] if int(index) < len(params) else f"scratch{index}"
        names[offset] = name
        if size == 8:
            names[offset + 4] = name + "+4"
        offset += size
    return names


def named_sass(name: str) -> str:
    kernel, params = compile_kernel(name)
    names = param_offsets(kernel.asm["ptx"], params)

    def by_name(m):
        return f"c[0x0][{names.get(int(m.group(1), 16), m.group(1))}]"

    lines = (
        _BANK.sub(by_name, line)
        for line in kernel.asm["sass"].splitlines()
        if not re.search(r"Function\s*:|\.text\.|\.section|^\s*//", line)
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    if argv[:1] == ["--diff"]:
        a, b = Path(argv[1]), Path(argv[2])
        for f in sorted(a.glob("*.sass")):
            other = b / f.name
            same = other.exists() and other.read_text() == f.read_text()
            print(f"{f.stem}: {'same' if same else 'DIFFERS'}")
        return
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for case in argv[1:] or sorted(CASES):
        (out / f"{case}.sass").write_text(named_sass(case))
        print(case, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
