from ds_fssdp.data.stdlib_corpus import load_corpus, sample_batch, split, stdlib_files

__all__ = ["load_corpus", "sample_batch", "split", "stdlib_files"]
