//! The SSD tier's two file formats, encoded and checked here.
//!
//! A **run file** (`<first>-<last>.kvrun`, named by the chained hashes of its first and last
//! blocks) holds a run
//! of consecutive full KV blocks of one token sequence. Its header says what the bytes are —
//! format version, namespace digest (model, tokenizer, KV scheme, block size, layout),
//! block size, bytes per block of each KV group, the snapshot group (a model with recurrent
//! state, whose "block" is the state snapshot after a block) — and, per block, its chained
//! hash, a CRC32 of its payload, whether it carries its snapshot, and its token ids; a CRC32
//! of the header closes it. The payload follows: block after block, each every other group's
//! bytes in group order, then the snapshot's where the block carries one (as `TierSlots` hold
//! them). The header alone gives the index everything it needs, so a start-up scan never
//! reads payloads. (Version 2 added the snapshot group and flags; a version-1 file is
//! another format: corrupt to this reader, deleted at start-up.)
//!
//! A **generation record** (`<key>.kvgen`) holds the prompt and the tokens generated so far
//! of an interrupted generation, keyed by a digest of (namespace, prompt, parameters).
//!
//! Anything that does not parse, has the wrong length or fails a checksum is `Corrupt`.

use std::io::Read;

/// Bumped whenever either format changes; part of every file and of the namespace digest.
pub const FORMAT_VERSION: u32 = 2;
const RUN_MAGIC: &[u8; 8] = b"FRKVRUN\0";
const GEN_MAGIC: &[u8; 8] = b"FRKVGEN\0";
/// Magic, version and header length.
const PREAMBLE: usize = 16;
/// No header is larger (a run of 64k blocks of 256 tokens): a bigger length is corruption.
const MAX_HEADER: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("corrupt cache file: {0}")]
    Corrupt(&'static str),
}

/// What a run file's header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunHeader {
    pub namespace: u64,
    pub block_size: u32,
    /// Bytes of one block of each KV group (a snapshot group's: a snapshot).
    pub group_bytes: Vec<u64>,
    /// The group whose block (a state snapshot) only some blocks carry.
    pub state_group: Option<u32>,
    /// Chained hash of each block.
    pub hashes: Vec<u64>,
    /// CRC32 of each block's payload.
    pub checksums: Vec<u32>,
    /// Whether each block carries its state snapshot.
    pub states: Vec<bool>,
    /// `block_size` token ids per block.
    pub tokens: Vec<u32>,
}

/// `RunHeader::state_group`'s encoding of "none".
const NO_GROUP: u32 = u32::MAX;

impl RunHeader {
    /// Bytes of a snapshot (0 without a snapshot group).
    fn state_bytes(&self) -> u64 {
        self.state_group.and_then(|g| self.group_bytes.get(g as usize)).copied().unwrap_or(0)
    }

    /// Bytes of a block carrying its snapshot (`state`) or not.
    pub fn block_bytes(&self, state: bool) -> u64 {
        let all: u64 = self.group_bytes.iter().sum();
        all - if state { 0 } else { self.state_bytes() }
    }

    /// Where each block's payload starts in the file, and where the file ends.
    pub fn offsets(&self) -> Vec<u64> {
        let mut at = self.encoded_len() as u64;
        let mut out = vec![at];
        for &s in &self.states {
            at += self.block_bytes(s);
            out.push(at);
        }
        out
    }

    /// Bytes of the encoded header (where the payload starts).
    pub fn encoded_len(&self) -> usize {
        PREAMBLE + 8 + 4 + 4 + 8 * self.group_bytes.len() + 4 + 4 + 13 * self.hashes.len() + 4 * self.tokens.len() + 4
    }

    /// Bytes of the whole file.
    pub fn file_len(&self) -> u64 {
        self.encoded_len() as u64 + self.states.iter().map(|&s| self.block_bytes(s)).sum::<u64>()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(RUN_MAGIC);
        put32(&mut out, FORMAT_VERSION);
        put32(&mut out, self.encoded_len() as u32);
        put64(&mut out, self.namespace);
        put32(&mut out, self.block_size);
        put32(&mut out, self.group_bytes.len() as u32);
        self.group_bytes.iter().for_each(|&b| put64(&mut out, b));
        put32(&mut out, self.state_group.unwrap_or(NO_GROUP));
        put32(&mut out, self.hashes.len() as u32);
        self.hashes.iter().for_each(|&h| put64(&mut out, h));
        self.checksums.iter().for_each(|&c| put32(&mut out, c));
        out.extend(self.states.iter().map(|&s| u8::from(s)));
        self.tokens.iter().for_each(|&t| put32(&mut out, t));
        let crc = crc32fast::hash(&out);
        put32(&mut out, crc);
        out
    }

    /// Read and check the header at the start of `r` (the payload is not read).
    pub fn read(r: &mut impl Read) -> Result<RunHeader, FileError> {
        let mut pre = [0u8; PREAMBLE];
        read_exact(r, &mut pre)?;
        let len = preamble(&pre, RUN_MAGIC)?;
        let mut buf = pre.to_vec();
        buf.resize(len, 0);
        read_exact(r, &mut buf[PREAMBLE..])?;
        let body = checked(&buf)?;
        let mut c = Cursor { buf: body, at: PREAMBLE };
        let namespace = c.u64()?;
        let block_size = c.u32()?;
        let groups = c.u32()? as usize;
        let group_bytes = (0..groups.min(1024)).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
        let state_group = Some(c.u32()?).filter(|&g| g != NO_GROUP);
        let n = c.u32()? as usize;
        let hashes = (0..n.min(body.len() / 8)).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
        let checksums = (0..n.min(body.len() / 4)).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?;
        let states = (0..n.min(body.len())).map(|_| c.flag()).collect::<Result<Vec<_>, _>>()?;
        let t = n.saturating_mul(block_size as usize);
        let tokens = (0..t.min(body.len() / 4)).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?;
        let h = RunHeader { namespace, block_size, group_bytes, state_group, hashes, checksums, states, tokens };
        let bad_group = state_group.is_some_and(|g| g as usize >= h.group_bytes.len());
        let stray_state = state_group.is_none() && h.states.contains(&true);
        if groups > 1024
            || h.hashes.len() != n
            || h.tokens.len() != t
            || c.at != body.len()
            || h.encoded_len() != len
            || bad_group
            || stray_state
        {
            return Err(FileError::Corrupt("header fields disagree with its length"));
        }
        Ok(h)
    }
}

/// A generation cut short: its prompt and the tokens generated so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenRecord {
    pub namespace: u64,
    pub key: u64,
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
}

impl GenRecord {
    pub fn encode(&self) -> Vec<u8> {
        let len = PREAMBLE + 8 + 8 + 4 + 4 + 4 * (self.prompt.len() + self.generated.len()) + 4;
        let mut out = Vec::with_capacity(len);
        out.extend_from_slice(GEN_MAGIC);
        put32(&mut out, FORMAT_VERSION);
        put32(&mut out, len as u32);
        put64(&mut out, self.namespace);
        put64(&mut out, self.key);
        put32(&mut out, self.prompt.len() as u32);
        put32(&mut out, self.generated.len() as u32);
        self.prompt.iter().chain(&self.generated).for_each(|&t| put32(&mut out, t));
        let crc = crc32fast::hash(&out);
        put32(&mut out, crc);
        out
    }

    pub fn decode(buf: &[u8]) -> Result<GenRecord, FileError> {
        let pre: &[u8; PREAMBLE] =
            buf.get(..PREAMBLE).and_then(|p| p.try_into().ok()).ok_or(FileError::Corrupt("short"))?;
        if preamble(pre, GEN_MAGIC)? != buf.len() {
            return Err(FileError::Corrupt("generation record length"));
        }
        let body = checked(buf)?;
        let mut c = Cursor { buf: body, at: PREAMBLE };
        let (namespace, key) = (c.u64()?, c.u64()?);
        let (p, g) = (c.u32()? as usize, c.u32()? as usize);
        if p.saturating_add(g).saturating_mul(4) != body.len() - c.at {
            return Err(FileError::Corrupt("generation record token counts"));
        }
        let prompt = (0..p).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?;
        let generated = (0..g).map(|_| c.u32()).collect::<Result<Vec<_>, _>>()?;
        Ok(GenRecord { namespace, key, prompt, generated })
    }
}

fn put32(out: &mut Vec<u8>, x: u32) {
    out.extend_from_slice(&x.to_le_bytes());
}
fn put64(out: &mut Vec<u8>, x: u64) {
    out.extend_from_slice(&x.to_le_bytes());
}

/// `read_exact`, with a short file reported as corruption (a truncated file).
fn read_exact(r: &mut impl Read, buf: &mut [u8]) -> Result<(), FileError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FileError::Corrupt("truncated"),
        _ => FileError::Io(e),
    })
}

/// Check the magic and version; the header (or record) length.
fn preamble(pre: &[u8; PREAMBLE], magic: &[u8; 8]) -> Result<usize, FileError> {
    if &pre[..8] != magic {
        return Err(FileError::Corrupt("bad magic"));
    }
    if u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]) != FORMAT_VERSION {
        return Err(FileError::Corrupt("another format version"));
    }
    let len = u32::from_le_bytes([pre[12], pre[13], pre[14], pre[15]]) as usize;
    if !(PREAMBLE + 4..=MAX_HEADER).contains(&len) {
        return Err(FileError::Corrupt("bad header length"));
    }
    Ok(len)
}

/// `buf` without its trailing CRC32, which must match.
fn checked(buf: &[u8]) -> Result<&[u8], FileError> {
    let (body, crc) = buf.split_at(buf.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(FileError::Corrupt("header checksum"));
    }
    Ok(body)
}

struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], FileError> {
        let b = self.buf.get(self.at..self.at + N).ok_or(FileError::Corrupt("header too short"))?;
        self.at += N;
        b.try_into().map_err(|_| FileError::Corrupt("header too short"))
    }
    fn u32(&mut self) -> Result<u32, FileError> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, FileError> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    fn flag(&mut self) -> Result<bool, FileError> {
        match self.take::<1>()? {
            [0] => Ok(false),
            [1] => Ok(true),
            _ => Err(FileError::Corrupt("a block's snapshot flag")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> RunHeader {
        RunHeader {
            namespace: 9,
            block_size: 2,
            group_bytes: vec![8, 4],
            state_group: Some(0),
            hashes: vec![1, 2],
            checksums: vec![3, 4],
            states: vec![false, true],
            tokens: vec![5, 6, 7, 8],
        }
    }

    #[test]
    fn blocks_with_a_snapshot_carry_its_bytes_after_the_others() {
        let h = header();
        // Block 0: group 1's 4 bytes; block 1: 4 + the snapshot's 8.
        let start = h.encoded_len() as u64;
        assert_eq!(h.offsets(), vec![start, start + 4, start + 16]);
        assert_eq!(h.file_len(), start + 16);
        let plain = RunHeader { state_group: None, states: vec![false, false], ..header() };
        assert_eq!(plain.file_len(), plain.encoded_len() as u64 + 24);
        assert_eq!(RunHeader::read(&mut &plain.encode()[..]).unwrap(), plain);
        // A flag without a snapshot group, or a group past the header's, is corrupt.
        let stray = RunHeader { state_group: None, ..header() };
        assert!(RunHeader::read(&mut &stray.encode()[..]).is_err());
        let past = RunHeader { state_group: Some(2), ..header() };
        assert!(RunHeader::read(&mut &past.encode()[..]).is_err());
        // A version-1 file (no snapshot fields) is another format.
        let mut old = h.encode();
        old[8..12].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(RunHeader::read(&mut &old[..]), Err(FileError::Corrupt("another format version"))));
    }

    #[test]
    fn headers_and_records_round_trip_and_any_flipped_byte_is_caught() {
        let h = header();
        let bytes = h.encode();
        assert_eq!(bytes.len(), h.encoded_len());
        assert_eq!(RunHeader::read(&mut &bytes[..]).unwrap(), h);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(RunHeader::read(&mut &bad[..]).is_err(), "flipped byte {i}");
        }
        assert!(matches!(RunHeader::read(&mut &bytes[..bytes.len() - 1]), Err(FileError::Corrupt("truncated"))));
        let r = GenRecord { namespace: 1, key: 2, prompt: vec![3, 4, 5], generated: vec![6] };
        let bytes = r.encode();
        assert_eq!(GenRecord::decode(&bytes).unwrap(), r);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            assert!(GenRecord::decode(&bad).is_err(), "flipped byte {i}");
        }
        assert!(GenRecord::decode(&bytes[..bytes.len() - 4]).is_err());
    }
}
