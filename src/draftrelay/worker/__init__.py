"""The remote drafter worker: sessions, draft KV with rollback, drafters, TCP server (docs/CONTRACT.md)."""
