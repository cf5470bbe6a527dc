"""Central router: tokenizes, classifies by uncached prompt length and latency class, picks
workers, and streams tokens back."""
