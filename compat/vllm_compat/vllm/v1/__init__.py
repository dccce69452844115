"""vLLM's v1 package: only the module paths vLLM's offline scripts import (metrics.reader)."""
