"""Offline data modules used by recipes: text corpus, synthetic, shapes, user arrays.

Nothing here downloads: data is generated, read from the user's files, or built from
the Python standard library's sources that every machine already has.
"""

from lightning_accel.data.arrays import ArrayDataModule, ArrayPairs
from lightning_accel.data.corpus import default_cache_dir, stdlib_corpus
from lightning_accel.data.shapes import SHAPE_KINDS, ShapesDataModule, render_shapes
from lightning_accel.data.synthetic import (
    SyntheticArrays,
    SyntheticDataModule,
    SyntheticImages,
    SyntheticStream,
    SyntheticTokens,
    item_generator,
)
from lightning_accel.data.text import ByteTokenizer, ByteWindows, TextDataModule

__all__ = [
    "SHAPE_KINDS",
    "ArrayDataModule",
    "ArrayPairs",
    "ByteTokenizer",
    "ByteWindows",
    "ShapesDataModule",
    "SyntheticArrays",
    "SyntheticDataModule",
    "SyntheticImages",
    "SyntheticStream",
    "SyntheticTokens",
    "TextDataModule",
    "default_cache_dir",
    "item_generator",
    "render_shapes",
    "stdlib_corpus",
]
