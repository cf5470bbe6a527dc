from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

_Floats = npt.NDArray[np.float64]

def best(running: _Floats, waiting: _Floats, memory: _Floats, cached: _Floats,
         ids: tuple[str, ...], placed: Mapping[str, int], weight: float,
         tiebreak: int, finished: Mapping[str, float] = ...) -> int: ...

def best_cost(length: float, dcached: _Floats, running: _Floats, prompt_waiting: _Floats,
              rate: _Floats, step: _Floats, dids: tuple[str, ...], pcached: _Floats,
              queued: _Floats, prate: _Floats, transfer: _Floats, pids: tuple[str, ...],
              placed: Mapping[str, int], inflight: Mapping[str, float],
              shares: _Floats | None, absorbed: float, row_fraction: float,
              stall_weight: float, tpot_weight: float, late_weight: float, overhead: float,
              max_local_s: float, target_s: float, ttft_weight: float,
              tiebreak: int, finished: Mapping[str, float] = ...
              ) -> tuple[int, int, bool, float, float]: ...

_Positions = npt.NDArray[np.intp]

class CostTable:
    def __init__(self, running: _Floats, prompt_waiting: _Floats, rate: _Floats,
                 step: _Floats, dids: tuple[str, ...], dpositions: _Positions,
                 queued: _Floats, prate: _Floats, transfer: _Floats, pids: tuple[str, ...],
                 ppositions: _Positions, absorbed: float, row_fraction: float,
                 stall_weight: float, tpot_weight: float, late_weight: float,
                 overhead: float, max_local_s: float) -> None: ...
    def choose(self, pairs: list[tuple[int, int]], scale: float, length: float,
               placed: Mapping[str, int], inflight: Mapping[str, float], target_s: float,
               ttft_weight: float, tiebreak: int, finished: Mapping[str, float] = ...
               ) -> tuple[int, int, bool, float, float, int, int]: ...
