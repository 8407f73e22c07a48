"""The ncu source-page reader: segments cut at barriers / wgmma waits, shares and stall reasons."""

from __future__ import annotations

from cula.kernels.common import ncu_phases as nc

CSV = '''"Kernel Name","k",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x0","LDG.E.128 R4, desc[UR4][R2.64]","10","4","8","2","8"
"0x10","@!P0 FFMA R1, R2, R3, R1","30","12","0","30","0"
"0x20","BAR.SYNC.DEFER_BLOCKING 0x0","20","4","20","0","20"
"0x30","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ","5","4","0","5","0"
"0x40","WARPGROUP.DEPBAR.LE gsb0, 0x0","35","4","35","0","35"
"0x50","EXIT","0","4","0","0","0"
'''


def test_segments_split_at_barriers_and_wgmma_waits():
    segs = nc.segments(nc.read_rows(CSV))
    assert [(s.first, s.last, s.ends_with) for s in segs] == [(0, 2, "BAR"), (3, 4, "WARPGROUP"), (5, 5, "")]
    assert [s.executed for s in segs] == [20, 8, 4]
    assert segs[0].opcodes["FFMA"] == 12  # the predicate guard is not the opcode


def test_stall_shares_leave_out_the_not_issued_split():
    shares = nc.stall_shares(nc.read_rows(CSV))
    assert set(shares) == {"long_sb", "wait"}
    assert abs(shares["long_sb"] - 100 * 63 / 100) < 1e-9 and abs(sum(shares.values()) - 100) < 1e-9


def test_report_gives_per_warp_counts():
    text = nc.report(CSV, warps=4, min_share=0.0)
    assert "long_sb 63.0, wait 37.0" in text
    assert "FFMA 3" in text  # 12 executed warp instructions over 4 warps
    assert text.count("rows") == 3
