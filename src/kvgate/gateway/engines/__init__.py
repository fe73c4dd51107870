"""Watching the engines: which engines there are (configured, found by DNS, changed by a
reload) and what state they are in (the scraper and its metrics-page client)."""
