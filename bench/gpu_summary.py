"""Summarise a bench/gpu.sh phase's folder as markdown: tokens/s of every run (ours from bench.json,
nanoGPT's from its "time per iteration" line, llm.c's from run.sh's last line), wall times and
exit codes, and the last lines of every other log.

    python bench/gpu_summary.py FOLDER
"""

import json
import re
import sys
from pathlib import Path


def rows(folder: Path) -> list:
    out = []
    for log in sorted(folder.glob("nanogpt_b*.log")):
        batch = int(log.stem.removeprefix("nanogpt_b"))
        found = re.findall(r"time per iteration: ([\d.]+)ms", log.read_text())
        if found:
            ms = float(found[-1])
            out.append((log.stem, f"{batch * 1024 / ms * 1e3:,.0f}", f"{ms:.1f} ms", "-", "-"))
    for report in sorted(folder.glob("*/bench.json")):
        run = json.loads(report.read_text())["runs"][0]
        mfu = "-" if run["mfu"] is None else f"{run['mfu']:.1%}"
        out.append((report.parent.name, f"{run['tokens_per_sec']:,.0f}", f"{run['step_time_s'] * 1e3:.1f} ms",
                    mfu, f"{run['peak_memory_bytes'] / 2**30:.1f} GiB"))
    for log in sorted(folder.glob("llmc*.log")):  # .gpu/llmc/run.sh's last line
        found = re.findall(r"^LLMC JSON (.*)$", log.read_text(), re.M)
        if found and "tokens_per_s" in found[-1]:
            r = json.loads(found[-1])
            out.append((log.stem, f"{r['tokens_per_s']:,.0f}", f"{r['mean_step_ms']:.1f} ms",
                        f"{r['mean_mfu_pct']:.1f}% (llm.c's)", "-"))
    return out


def main(folder: Path):
    print(f"## {folder.name}\n\n```\n{(folder / 'env.txt').read_text().strip()}\n```\n")
    table = rows(folder)
    if table:
        print("| run | tokens/s | step | MFU | peak memory |\n|---|---|---|---|---|")
        print("\n".join("| " + " | ".join(r) + " |" for r in table) + "\n")
    times = folder / "times.txt"
    print("```\n" + (times.read_text() if times.exists() else "") + "```\n")
    for log in sorted(folder.glob("*.log")):
        lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()]
        print(f"### {log.stem}\n```\n" + "\n".join(l[:200] for l in lines[-6:]) + "\n```")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
