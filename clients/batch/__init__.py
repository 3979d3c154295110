"""`tandem batch`: OpenAI batch files (JSONL) answered by a tandem serve (batch_file.py, batch_run.py)."""
