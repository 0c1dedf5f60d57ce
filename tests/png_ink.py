#!/usr/bin/env python3
"""Ink in a screenshot: how many sampled pixels differ from the top-left one.

Usage: png_ink.py SHOT.png  ->  prints "WIDTH HEIGHT INK"

Chromium's --screenshot writes 8-bit RGB or RGBA PNGs, non-interlaced; this
decodes them with zlib alone (no imaging library on the test machines) and
samples every fourth pixel of every fourth row. The page background is the
top-left pixel; a pixel is ink when its colour differs from it by more than
60 (sum over R, G, B). A blank viewport has no ink.
"""
import struct
import sys
import zlib


def rows_of(path):
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"{path}: not a PNG")
    pos, idat = 8, b""
    width = height = bpp = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or color not in (2, 6) or interlace:
                raise SystemExit(f"{path}: depth {depth}, colour type {color}, interlace {interlace}: not read here")
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * bpp
    prev, out = bytearray(stride), []
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out.append(bytes(line))
        prev = line
    return width, height, bpp, out


def main():
    width, height, bpp, rows = rows_of(sys.argv[1])
    bg = rows[0][:3]
    ink = 0
    for row in rows[::4]:
        for x in range(0, width * bpp, bpp * 4):
            ink += abs(row[x] - bg[0]) + abs(row[x + 1] - bg[1]) + abs(row[x + 2] - bg[2]) > 60
    print(width, height, ink)


main()
