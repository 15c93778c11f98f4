"""DLRM pieces: embedding-table kernels, synthetic (Zipf + LFSR) data and the Criteo loader."""

from .criteo import CriteoDataset, convert_criteo, parse_line, read_criteo, write_tiny_criteo
from .data import (
    LFSR_MASKS,
    Batch,
    LFSRScrambler,
    SyntheticDataset,
    ZipfSampler,
    lfsr_is_maximal,
    lfsr_period,
    lfsr_step,
)
from .kernels import (
    accumulate_grad,
    check_indices,
    check_offsets,
    lookup,
    lookup_many,
    lookup_sum,
    lookup_sum_indirect,
    sgd_update,
    sgd_update_indirect,
    update_many,
)

__all__ = [
    "accumulate_grad", "check_indices", "check_offsets", "lookup", "lookup_many", "lookup_sum",
    "lookup_sum_indirect", "sgd_update", "sgd_update_indirect", "update_many",
    "LFSR_MASKS", "Batch", "LFSRScrambler", "SyntheticDataset", "ZipfSampler",
    "lfsr_is_maximal", "lfsr_period", "lfsr_step",
    "CriteoDataset", "convert_criteo", "parse_line", "read_criteo", "write_tiny_criteo",
]

# Embedding tables, CachedEmbeddings and the DLRM model.
from .configs import DLRMConfig, get_config  # noqa: E402
from .embedding import (FLUSH_POLICIES, FORWARD, UPDATE, CachedEmbeddingTable,  # noqa: E402
                        EmbeddingTable, SimpleTable, lookup_tables, make_table, traffic_time,
                        update_tables)
from .model import DLRM, demo, synthetic_dataset  # noqa: E402
__all__ += ["DLRMConfig", "get_config", "FLUSH_POLICIES", "FORWARD", "UPDATE", "EmbeddingTable",
            "SimpleTable",
            "CachedEmbeddingTable", "make_table", "lookup_tables", "update_tables", "traffic_time",
            "DLRM", "demo",
            "synthetic_dataset"]
