"""Language-model data: corpora, memory-mapped token files, packing and a resumable iterator.

prepare_token_files(documents, "data/mine")            # or: ember data prepare *.txt --out data/mine
data = TokenDataset.open("data/mine")
batches = PackedBatches(data.train, seq_len=256, global_batch=32, seed=0)
batch = batches.next()      # tokens/targets/segment_ids/positions/loss_mask [local_batch, seq_len]
state = batches.state()     # saved in the checkpoint; batches.restore(state) resumes exactly
"""

from ember.training.data.corpus import stdlib_corpus_dir, stdlib_documents
from ember.training.data.iterator import PackedBatches
from ember.training.data.packing import pack_window
from ember.training.data.token_files import TokenDataset, prepare_token_files

__all__ = [
    "PackedBatches",
    "TokenDataset",
    "pack_window",
    "prepare_token_files",
    "stdlib_corpus_dir",
    "stdlib_documents",
]
