"""Members of email groups, imported from CSV files by a singleton Celery task."""
