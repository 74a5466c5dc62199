"""The sampling options of `ember run`, `ember generate` and `ember chat`."""
from __future__ import annotations

import argparse


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """The sampling options a left out option leaves to the model's recommendation (its file's, else
    llama.cpp's: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); --temperature 0 is greedy (over a repetition
    penalty the model recommends; --repetition-penalty 1 for none)."""
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the model's recommendation)")
    p.add_argument("--top-k", type=int, help="sample among the k best tokens, 0 = all (default: the model's)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: the model's)")
    p.add_argument("--min-p", type=float, help="drop tokens below min_p x the best probability (default: the model's)")
    p.add_argument("--repetition-penalty", type=float,
                   help="llama.cpp-style multiplicative penalty, 1 = off (default: the model's)")
