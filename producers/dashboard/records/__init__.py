"""What the dashboard reads and writes record by record: jobs, searches, dead letters,
daemon controls, and the audit trail of operator actions (with their key names)."""
