"""Tables and summaries built from finished run folders (``python -m kvresearch.reports.<name>``)."""
