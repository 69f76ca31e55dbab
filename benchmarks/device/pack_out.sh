# Sourced by the device scripts whose outputs exceed what a device call returns (at most 8 files):
#   pack_out DIR NAME   packs every file under DIR except the .tar files into DIR/NAME.tar, deletes those files and
#                       lists what is left (the tar and the students' own tars).
pack_out() {
    tar -C "$1" --exclude='*.tar' -cf "$1/$2.tar" . || return 1
    find "$1" -mindepth 1 -not -name '*.tar' -type f -delete
    ls -laR "$1"
}
