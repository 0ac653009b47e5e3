"""A mount's ``--metrics`` as a test or a benchmark reads it: scraped over HTTP as Prometheus
does, and parsed by prometheus_client's own parser, so what is checked is what a Prometheus
server would store."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

#: A scrape's samples: value by (sample name, its labels).
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_text(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as reply:
        return reply.read().decode()


def samples(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    return samples(scrape_text(port, host))


def value(scraped: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels``; KeyError if the scrape has none."""
    return scraped[(name, frozenset(labels.items()))]


def series_names(text: str) -> set[str]:
    """The series a scrape declares, with or without samples yet (a counter of failures by
    cause has none until something failed)."""
    return {family.name + ("_total" if family.type == "counter" else "")
            for family in text_string_to_metric_families(text)}
