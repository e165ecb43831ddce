"""Whether the kernels of one CUDA source compile to the same PTX in two trees (BENCHMARKS.md,
session 37): each tree's file goes through `nvcc -ptx`, kernel names are matched after dropping
text the new tree's names add (a template argument's mangling), and register numbers, labels and
symbol names are normalised before the bodies are compared. Same PTX means the same machine code from ptxas, so a
change that keeps a kernel's PTX cannot change its speed. No GPU needed.

    python scripts/compare_ptx.py scratch/base kernels/cuda/decode_mma.cu --drop Lb0E
    python scripts/compare_ptx.py scratch/base kernels/cuda/wgmma_sp.cu --arch sm_90a   # warpgroup kernels

Kernels in an anonymous namespace are matched by name without the hash of the file's path that
their mangled names carry (it differs between trees)."""
import argparse
import re
import subprocess
import tempfile
from pathlib import Path

NVCC = "/usr/local/cuda/bin/nvcc"


def kernels(tree: Path, source: str, arch: str) -> dict[str, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.ptx"
        subprocess.run([NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-ptx", source, "-o", str(out)], cwd=tree,
                       check=True)
        text = out.read_text()
    bodies = {}
    for match in re.finditer(r"\.entry (\S+)\(", text):
        end = text.index("\n}\n", match.start())
        body = text[match.start():end].replace(match.group(1), "KERNEL")
        body = re.sub(r"_ZZ?N\w+", "SYMBOL", body)
        body = re.sub(r"%[a-z]+\d+", "%R", body)
        body = re.sub(r"\$L__BB\d+_\d+", "LABEL", body)
        # kernels in an anonymous namespace carry a hash of the file's path, which differs per tree
        bodies[re.sub(r"_GLOBAL__N__\w+?_cu_[0-9a-f]+", "ANON", match.group(1))] = body.splitlines()
    return bodies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the other tree (e.g. git archive <commit> | tar -x -C scratch/base)")
    parser.add_argument("source", help="CUDA source, relative to both trees")
    parser.add_argument("--drop", default="", help="text the new tree's kernel names add, dropped to match them")
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    old = kernels(args.base, args.source, args.arch)
    new = kernels(Path.cwd(), args.source, args.arch)
    matched = 0
    for name, body in sorted(new.items()):
        base_name = name.replace(args.drop, "") if args.drop else name
        if base_name not in old:
            continue
        matched += 1
        print(("same     " if body == old[base_name] else "DIFFERENT"), name)
    print(f"{matched} kernels matched of {len(new)} new, {len(old)} old")


if __name__ == "__main__":
    main()
