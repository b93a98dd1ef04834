"""Where prompts come from beyond data.py's .jsonl files and the built-in task:
hf_datasets.py (the hub, dataset folders, json/csv/parquet)."""
