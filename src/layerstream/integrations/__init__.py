"""Integrations with the Hugging Face training stack."""
