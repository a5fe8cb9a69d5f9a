"""The VRAM ledger: every device byte a named line, in a fixed order, printable as a
table with MiB and share of the card. No torch.

    total VRAM
      - other processes
      - dense weights
      - sequence state     (KV / MLA latent per token, recurrent state per layer)
      - reserve            (prompt path, verify arena, draft head, decode graphs, headroom)
      - expert cache
      = free after start
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20

OTHER, DENSE, KV, RESERVE, CACHE, FREE = (
    "other processes", "dense weights", "sequence state", "reserve", "expert cache", "free after start")
PROMPT, VERIFY, DRAFT, GRAPHS, HEADROOM = "prompt path", "verify arena", "draft head", "decode graphs", "headroom"


@dataclass(frozen=True)
class Line:
    name: str
    bytes: int
    parts: tuple["Line", ...] = field(default=())
    note: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "parts": [p.to_json() for p in self.parts],
                **({"note": self.note} if self.note else {})}


def mib(n: int) -> float:
    return n / MIB


def render(lines: list[Line], total: int, title: str) -> str:
    """The ledger as an aligned table: name, MiB, share of the card, note. A small
    (simulated) card gets two decimals so that its lines do not all round to zero."""
    fmt = "{:,.0f}" if total >= 1024 * MIB else "{:,.2f}"
    rows = [(title, fmt.format(mib(total)), "100.0%", "")]
    for line in lines:
        sign = "=" if line.name == FREE else "-"
        rows.append((f"  {sign} {line.name}", fmt.format(mib(line.bytes)), _share(line.bytes, total), line.note))
        for part in line.parts:
            rows.append((f"        {part.name}", fmt.format(mib(part.bytes)), _share(part.bytes, total), part.note))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    out = [f"{r[0]:<{w0}}  {r[1]:>{w1}} MiB  {r[2]:>6}  {r[3]}".rstrip() for r in rows]
    return "\n".join(out)


def _share(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "-"
