"""Training and validation data: documents, tokenised and packed into sequences in one global order that does not
depend on the parallel layout (docs/data.md).

The package, one concern per module:

    config.py   the [dataset] section, and DatasetError: a dataset setting that cannot work, with the key at fault
    sources.py  the documents a [dataset] section names: local json/jsonl/parquet/txt files or folders of them, the
                shipped pydoc corpus, Hugging Face datasets (offline unless allow_download); a held-out split
    loader.py   PackedDataLoader: tokenising, packing, each rank's share of the global batch, epochs, its
                layout-independent state_dict; build_dataloader
    pretokenized.py  the token files `python -m trainer.pretokenize` writes, and PretokenizedLoader: the same
                batches and state, each rank reading only its own sequences, memory-mapped
    for_job.py  the job's loaders: which section training and validation read (a held-out part of local files,
                validation.dataset, a validation split), built and checked before launch, and the job's config
                key behind a DatasetError
"""
