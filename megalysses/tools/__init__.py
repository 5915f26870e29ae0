"""The command-line tools, importable (`from megalysses.tools import preprocess_data`) and installed as
console scripts; tools/*.py and pretrain.py at the repository root run the same `cli()` functions.

    pretrain          megalysses-pretrain        torchrun ... pretrain.py --config C
    preprocess_data   megalysses-preprocess      jsonl / Parquet / Arrow / text folder -> Megatron .bin/.idx;
                                                 --chat: conversations, and the loss mask of their answers
    merge_datasets    megalysses-merge-datasets  a folder of .bin/.idx shards -> one dataset
    train_tokenizer   megalysses-train-tokenizer sentencepiece BPE from jsonl / Parquet / Arrow / text
    generate          megalysses-generate        sample from a run's checkpoint
    plot_metrics      megalysses-plot            metrics.jsonl -> PNG
    build_corpus      megalysses-build-corpus    the stdlib corpus of the quickstart
    plan              megalysses-plan            layouts that fit a model at a length, ranked by throughput
    from_megatron     megalysses-from-megatron   a Megatron-LM pretrain_gpt.py command line -> a config
    config_doc        (tools/config_doc.py)      docs/CONFIG.md from the config schema (make docs)
"""
