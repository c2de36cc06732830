"""What a person looks at after a run: ``report.html`` (``html.py``) and the per-phase meter."""
