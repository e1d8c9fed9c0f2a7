"""Communication: QComms precisions and codecs (the one table of wire bytes), bytes per collective,
the dense gradients' two-stage all-reduce."""

from lightning_recsys.parallel.comms.codecs import BYTE_DTYPES, SCALE_BYTES, BlockScaledCodec, wire_bytes_per_value
from lightning_recsys.parallel.comms.comm_accounting import (
    CommAccountant,
    comm_for_batch,
    comm_purpose,
    discard_batch_comm,
    release_batch_comm,
)
from lightning_recsys.parallel.comms.dense_all_reduce import staged_all_reduce_hook, uses_staged_all_reduce
from lightning_recsys.parallel.comms.qcomms import (
    EffectiveQComms,
    QCommsCodecs,
    QCommsConfig,
    dense_grads_hook,
    resolve_qcomms,
)

__all__ = [
    "BYTE_DTYPES",
    "BlockScaledCodec",
    "CommAccountant",
    "EffectiveQComms",
    "QCommsCodecs",
    "QCommsConfig",
    "SCALE_BYTES",
    "comm_for_batch",
    "comm_purpose",
    "dense_grads_hook",
    "discard_batch_comm",
    "release_batch_comm",
    "resolve_qcomms",
    "staged_all_reduce_hook",
    "uses_staged_all_reduce",
    "wire_bytes_per_value",
]
