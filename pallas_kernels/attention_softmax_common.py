"""The row layout both attention softmax lowerings read: which query and which mask row a row of
the flattened scores (B * H * Tq, Tk) belongs to."""

from typing import NamedTuple


class Layout(NamedTuple):
    """Static facts the kernels (both backends) need to find a row's query index and mask row."""

    heads: int
    n_queries: int
    mask_batch: bool  # mask varies over B
    mask_query: bool  # mask varies over Tq
    mask_rows: int  # Tq or 1: rows of mask per batch entry
