from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

_Floats = npt.NDArray[np.float64]

def best(running: _Floats, waiting: _Floats, memory: _Floats, cached: _Floats,
         ids: tuple[str, ...], placed: Mapping[str, int], weight: float,
         tiebreak: int) -> int: ...
