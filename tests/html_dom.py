"""Parse an HTML document into its start tags and text (shared by the report and browser tests)."""

from __future__ import annotations

from html.parser import HTMLParser


class Elements(HTMLParser):
    """Every start tag with its attributes, and all text, of an HTML document."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)
