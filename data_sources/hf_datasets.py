"""Datasets through HF datasets: a hub id (with its config and split), a local
dataset folder, and .json/.jsonl/.csv/.parquet files with any split. data.py
reads .jsonl files itself (its load_prompt_dataset, simplification 1): datasets
and its Arrow tables keep ~80 MB resident for the whole run.

    python train.py --dataset openai/gsm8k --dataset-config main \\
        --prompt-column question --solution-column answer

Run the tests: python -m pytest -q tests/test_data.py
"""
import glob
import os

from common import cause
from data import check_files_exist, json_lines

LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_with_datasets(paths, exts, config, split, name_or_path):
    """Files (paths, of the extensions exts) or a hub id or folder -> a
    datasets.Dataset of split; ValueError saying what to fix."""
    # imported here: it costs a second that the built-in task does not need
    import datasets

    # per-shard bars would break the step bar
    datasets.disable_progress_bars()

    if exts <= set(LOADERS):
        return _load_files(datasets, paths, exts, split, name_or_path)
    if len(paths) == 1 and not os.path.isfile(paths[0]):
        return _load_hub_or_folder(datasets, paths[0], config, split)
    raise ValueError(f"cannot load dataset {name_or_path!r}: give a hub id, a "
                     f"dataset folder or files ending in {', '.join(LOADERS)}")


def _load_files(datasets, paths, exts, split, name_or_path):
    """Local .json/.jsonl/.csv/.parquet files of one format -> a datasets.Dataset."""
    check_files_exist(paths)

    if len({LOADERS[e] for e in exts}) > 1:
        raise ValueError(f"dataset files mix formats {sorted(exts)}: "
                         "use one of json/jsonl, csv, parquet")

    _check_json_lines(paths)

    # datasets raises StopIteration on an empty .jsonl, ValueError on "[]" or an
    # unknown split
    try:
        return datasets.load_dataset(LOADERS[exts.pop()], data_files=paths, split=split)
    except (StopIteration, ValueError) as e:
        raise ValueError(f"cannot load split {split!r} of {name_or_path!r}: "
                         f"{str(e) or 'no rows'} (local files are one split, 'train', "
                         "and slices like 'train[:100]' work; empty files have no "
                         "rows)") from e
    except Exception as e:
        # a malformed file: datasets' DatasetGenerationError, pyarrow's errors
        raise ValueError(f"cannot read dataset {name_or_path!r}: {cause(e)}: "
                         "fix the file") from None


def _load_hub_or_folder(datasets, path, config, split):
    """A hub id or a local dataset folder -> a datasets.Dataset."""
    try:
        return datasets.load_dataset(path, config, split=split)
    except Exception as e:
        # not a dataset folder, offline (HF_HUB_OFFLINE=1, no network), unknown
        # config or split
        if os.path.isdir(path):
            what = "the folder"
        else:
            what = ("the hub id (offline? HF_HUB_OFFLINE=1 or no network reads only the "
                    "local cache)")
        raise ValueError(f"cannot load dataset {path!r} ({cause(e)}): check {what}, "
                         "or give .json/.jsonl/.csv/.parquet file(s)") from None


def _check_json_lines(paths):
    """A .jsonl line that is not JSON -> ValueError naming the file and line.

    datasets names neither.
    """
    for pattern in paths:
        if pattern.lower().endswith(".jsonl"):
            for path in sorted(glob.glob(pattern)):
                # every line parsed: json_lines raises at the first bad one
                for _ in json_lines(path):
                    pass
