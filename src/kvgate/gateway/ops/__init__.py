"""Operations: kvgate's own metrics and access log, and the operator's live dashboard."""
