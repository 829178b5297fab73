"""The draft service: proposes k tokens per session with a draft model or n-grams."""
